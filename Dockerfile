# leash worker: a static binary on a distroless base.
#   docker build -t leash-worker .
#   docker run --rm -e DATABASE_URL=postgres://... leash-worker migrate
#   docker run --rm -e DATABASE_URL=postgres://... -e WORKER_ADMIN_TOKEN=... -p 127.0.0.1:8080:8080 leash-worker
# Without WORKER_ADMIN_TOKEN the worker makes a random admin token at start and logs it once
# (WORKER_HTTP_ADDR=:8080 is not loopback only).
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/worker ./cmd/worker

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/worker /worker
ENV WORKER_HTTP_ADDR=:8080 \
    LOG_FORMAT=json
EXPOSE 8080
USER nonroot:nonroot
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s CMD ["/worker", "health"]
ENTRYPOINT ["/worker"]
CMD ["run"]
