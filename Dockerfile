# leash worker: a static binary on a distroless base.
#   docker build -t leash-worker .
#   docker run --rm -e DATABASE_URL=postgres://... leash-worker migrate
#   docker run --rm -e DATABASE_URL=postgres://... -e WORKER_ADMIN_TOKEN=... -p 127.0.0.1:8080:8080 leash-worker
# Without WORKER_ADMIN_TOKEN the worker makes a random admin token at start and logs it once
# (WORKER_HTTP_ADDR=:8080 is not loopback only). Add -e OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318
# to export traces.
# The binary is a module of its own (cmd/worker, with OpenTelemetry), built against the library
# and the otel module of this tree through the workspace (go.work), which takes every module's
# go.mod: the go command reads them all before it builds.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.work go.work.sum go.mod go.sum ./
COPY otel/go.mod otel/go.sum ./otel/
COPY cmd/worker/go.mod cmd/worker/go.sum ./cmd/worker/
COPY bench/go.mod bench/go.sum ./bench/
RUN cd cmd/worker && go mod download
COPY . .
# docker build --build-arg REVISION=$(git rev-parse HEAD) records the commit (worker version).
ARG REVISION=unknown
RUN cd cmd/worker && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.revision=${REVISION}" -o /out/worker .

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/worker /worker
ENV WORKER_HTTP_ADDR=:8080 \
    LOG_FORMAT=json
EXPOSE 8080
USER nonroot:nonroot
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s CMD ["/worker", "health"]
ENTRYPOINT ["/worker"]
CMD ["run"]
