package main

import (
	"strings"
	"testing"
)

func TestWorkerCommand(t *testing.T) {
	t.Parallel()
	src := "/home/ana/leash/cmd/worker"
	goRun := "/tmp/go-build2251261829/b001/exe/worker"
	for _, c := range []struct{ exe, arg0, srcDir, cwd, want string }{
		{goRun, goRun, src, "/home/ana/leash", "go run ./cmd/worker"},
		{goRun, goRun, src, "/home/ana/leash/cmd/worker", "go run ."},
		{goRun, goRun, src, "/home/ana/leash/cmd", "go run ./worker"},
		{goRun, goRun, src, "/home/ana", "go run ./leash/cmd/worker"},
		{goRun, goRun, src, "/srv", "go run -C /home/ana/leash/cmd/worker ."},
		{goRun, goRun, src, "/home/ana/leash/pool", "go run -C /home/ana/leash/cmd/worker ."},
		{goRun, goRun, "/home/ana/my leash/cmd/worker", "/tmp", "go run -C '/home/ana/my leash/cmd/worker' ."},
		{"/root/.cache/go-build/ab/abcdef-d/worker", "worker", src, "/home/ana/leash", "go run ./cmd/worker"},
		{goRun, goRun, "", "/home/ana/leash", "go run ./cmd/worker"}, // -trimpath
		{"/home/ana/go/bin/worker", "worker", src, "/srv", "worker"},
		{"/home/ana/leash/cmd/worker/worker", "./worker", src, "/home/ana/leash/cmd/worker", "./worker"},
		{"/opt/leash/worker", "/opt/leash/worker", "", "/", "/opt/leash/worker"},
	} {
		if got := workerCommand(c.exe, c.arg0, c.srcDir, c.cwd); got != c.want {
			t.Errorf("workerCommand(%q, %q, %q, %q) = %q, want %q", c.exe, c.arg0, c.srcDir, c.cwd, got, c.want)
		}
	}
}

func TestDemoNext(t *testing.T) {
	t.Parallel()
	private := demoNext("go run ./cmd/worker", "")
	for _, want := range []string{"export DATABASE_URL='postgres://USER:PASSWORD@HOST:5432/DBNAME'",
		"  go run ./cmd/worker migrate ", "  go run ./cmd/worker run ", "  go run ./cmd/worker status ",
		`  go run ./cmd/worker enqueue -kind sleep -payload '{"duration":"5s"}'`, "NOTIFY job_revoked"} {
		if !strings.Contains(private, want) {
			t.Errorf("closing lines lack %q:\n%s", want, private)
		}
	}
	for url, want := range map[string]string{
		"postgres://ana:s3cret@db.example:5432/jobs?sslmode=require": "export DATABASE_URL='postgres://ana:PASSWORD@db.example:5432/jobs?sslmode=require'",
		"postgres:///jobs":                             "export DATABASE_URL=postgres:///jobs",
		"postgresql://ana@db/jobs?password=s3cret":     "export DATABASE_URL='postgresql://ana@db/jobs?password=PASSWORD'",
		"host=db user=ana password='s3 cret' dbname=x": "export DATABASE_URL='host=db user=ana password=PASSWORD dbname=x'",
		"host=db password=s3cret":                      "export DATABASE_URL='host=db password=PASSWORD'",
	} {
		got := demoNext("worker", url)
		if !strings.Contains(got, want+"\n") || strings.Contains(got, "s3") || !strings.Contains(got, "  worker run ") {
			t.Errorf("with DATABASE_URL %s, closing lines:\n%s\nwant %s", url, got, want)
		}
	}
}
