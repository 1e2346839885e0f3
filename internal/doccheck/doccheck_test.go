package doccheck_test

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/leashq/leash/internal/doccheck"
)

var update = flag.Bool("update", false, "rewrite the docs' snippet blocks from the example regions")

// root is the repository's root, two levels above this package's directory (where go test runs
// it), whatever the environment says.
func root(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	mod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil || !bytes.HasPrefix(mod, []byte("module github.com/leashq/leash\n")) {
		t.Fatalf("%s is not the repository's root: %v", dir, err)
	}
	return dir
}

// The docs' snippet blocks equal the example regions they name (-update rewrites them).
func TestSnippets(t *testing.T) {
	dir := root(t)
	fsys := os.DirFS(dir)
	regions, problems := doccheck.CollectRegions(fsys)
	for _, p := range problems {
		t.Error(p)
	}
	for _, file := range doccheck.SnippetFiles(fsys) {
		md, err := os.ReadFile(filepath.Join(dir, file))
		if err != nil {
			t.Fatal(err)
		}
		out, problems := doccheck.Snippets(file, md, regions, *update)
		for _, p := range problems {
			t.Error(p)
		}
		if out != nil {
			if err := os.WriteFile(filepath.Join(dir, file), out, 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: snippets rewritten", file)
		}
	}
}

// Every relative link of the docs leads to a file, and every anchor to a heading.
func TestLinks(t *testing.T) {
	fsys := os.DirFS(root(t))
	for _, p := range doccheck.CheckLinks(fsys, doccheck.LinkFiles(fsys)) {
		t.Error(p)
	}
}

// The package comment lists exactly the regions the examples define, for doc writers to pick.
func TestRegionsListed(t *testing.T) {
	regions, _ := doccheck.CollectRegions(os.DirFS(root(t)))
	src, err := os.ReadFile("doccheck.go")
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, m := range regexp.MustCompile(`(?m)^//   - ([a-z0-9, -]+):`).FindAllStringSubmatch(string(src), -1) {
		listed = append(listed, strings.Split(m[1], ", ")...)
	}
	var defined []string
	for name := range regions {
		defined = append(defined, name)
	}
	slices.Sort(listed)
	slices.Sort(defined)
	if !slices.Equal(listed, defined) {
		t.Errorf("the package comment lists regions %v; the examples define %v", listed, defined)
	}
}

// example is Go source with regions, its markers written "@" so that this file defines none.
var example = strings.ReplaceAll(`package x

func f() {
	@start hello
	@start inner
	if true {
		println("hello")
	}
	@end inner

	println("bye")
	@end hello
}
`, "@", "// snippet:")

func TestParseRegions(t *testing.T) {
	regions, problems := doccheck.ParseRegions("x.go", []byte(example))
	if len(problems) != 0 {
		t.Fatal(problems)
	}
	want := []doccheck.Region{
		{Name: "inner", File: "x.go", Line: 5, Text: "if true {\n\tprintln(\"hello\")\n}\n"},
		{Name: "hello", File: "x.go", Line: 4, Text: "if true {\n\tprintln(\"hello\")\n}\n\nprintln(\"bye\")\n"},
	}
	if !slices.Equal(regions, want) {
		t.Fatalf("got %#v\nwant %#v", regions, want)
	}

	for name, c := range map[string]struct{ src, want string }{
		"no end":        {"// snippet:start a\nx\n", "x.go:1: snippet a has no end"},
		"no start":      {"x\n// snippet:end a\n", "x.go:2: snippet a ends without a start"},
		"started twice": {"// snippet:start a\n// snippet:start a\nx\n// snippet:end a\n", "x.go:2: snippet a starts again before it ended (line 1)"},
		"empty":         {"// snippet:start a\n\n// snippet:end a\n", "x.go:1: snippet a is empty"},
		"bad name":      {"// snippet:start A_b\n", `x.go:1: snippet name "A_b": use lower case letters, digits and -`},
	} {
		t.Run(name, func(t *testing.T) {
			_, problems := doccheck.ParseRegions("x.go", []byte(c.src))
			if len(problems) != 1 || problems[0].String() != c.want {
				t.Fatalf("got %v, want %s", problems, c.want)
			}
		})
	}
}

func TestSlug(t *testing.T) {
	for heading, want := range map[string]string{
		"Embedding":                       "embedding",
		"From a SQL console":              "from-a-sql-console",
		"Admin page: charts, and cost":    "admin-page-charts-and-cost",
		"`pool.Config` fields":            "poolconfig-fields",
		"What's new in 0.2.0?":            "whats-new-in-020",
		"snake_case and kebab-case":       "snake_case-and-kebab-case",
		"A [link](other.md) and **bold**": "a-link-and-bold",
		"Ünïcode  two spaces":             "ünïcode--two-spaces",
	} {
		if got := doccheck.Slug(heading); got != want {
			t.Errorf("Slug(%q) = %q, want %q", heading, got, want)
		}
	}
}

// A broken link, a broken anchor, a stale or unknown snippet fail, each named by file and line;
// sound ones pass.
func TestCheck(t *testing.T) {
	const ex = "package x\n\nfunc f() {\n\t// snippet:start hi\n\tprintln(\"hi\")\n\t// snippet:end hi\n}\n"
	const doc = "# Guide\n\n## Usage\n\n## Usage\n\nSetext heading\n---\n\n<a id=\"custom\"></a>\n"
	for name, c := range map[string]struct {
		md   string
		want []string // problems, as file:line: message prefixes
	}{
		"sound": {md: "# Title\n\n" +
			"See [the guide](docs/guide.md), [usage](docs/guide.md#usage), [again](docs/guide.md#usage-1),\n" +
			"[setext](docs/guide.md#setext-heading), [custom](docs/guide.md#custom), [top](#title),\n" +
			"[a dir](docs), [root](/docs/guide.md), [web](https://example.com/x.md#nope), [mail](mailto:a@b.c).\n\n" +
			"[ref]: docs/guide.md#guide\n\n" +
			"<!-- snippet: hi -->\n```go\nprintln(\"hi\")\n```\n\n" +
			"```md\n[in code](nowhere.md) # Not a heading\n```\n" +
			"Inline `[in a code span](nowhere.md)` is not a link.\n"},
		"broken link": {md: "# T\n\nSee [it](docs/nothing.md).\n",
			want: []string{"README.md:3: link docs/nothing.md: no file docs/nothing.md"}},
		"broken anchor": {md: "# T\n\n[a](docs/guide.md#usage-2)\n[b](#t)\n[c](#nope)\n",
			want: []string{"README.md:3: link docs/guide.md#usage-2: no heading of docs/guide.md has anchor #usage-2",
				"README.md:5: link #nope: no heading of README.md has anchor #nope"}},
		"outside": {md: "[x](../x.md)\n", want: []string{"README.md:1: link ../x.md leaves the repository"}},
		"stale snippet": {md: "# T\n\n<!-- snippet: hi -->\n```go\nprintln(\"hello\")\n```\n",
			want: []string{"README.md:3: snippet hi is stale: it differs from x.go:4"}},
		"unknown snippet": {md: "<!-- snippet: bye -->\n```go\n```\n",
			want: []string{"README.md:1: unknown snippet bye"}},
		"snippet without block": {md: "<!-- snippet: hi -->\n\n```go\nprintln(\"hi\")\n```\n",
			want: []string{"README.md:1: snippet hi: the next line must open a fenced code block"}},
		"snippet block not closed": {md: "<!-- snippet: hi -->\n```go\nprintln(\"hi\")\n",
			want: []string{"README.md:1: snippet hi: its code block is not closed"}},
	} {
		t.Run(name, func(t *testing.T) {
			fsys := fstest.MapFS{
				"x.go":          {Data: []byte(ex)},
				"README.md":     {Data: []byte(c.md)},
				"docs/guide.md": {Data: []byte(doc)},
			}
			regions, problems := doccheck.CollectRegions(fsys)
			if len(problems) != 0 {
				t.Fatal(problems)
			}
			_, snips := doccheck.Snippets("README.md", []byte(c.md), regions, false)
			got := append(snips, doccheck.CheckLinks(fsys, doccheck.LinkFiles(fsys))...)
			if len(got) != len(c.want) {
				t.Fatalf("got %v, want %v", got, c.want)
			}
			for i, p := range got {
				if !strings.HasPrefix(p.String(), c.want[i]) {
					t.Errorf("got %s, want %s...", p, c.want[i])
				}
			}
		})
	}
}

// -update rewrites stale blocks from their regions, keeping the fences and their indentation,
// and leaves unknown ones as problems.
func TestUpdate(t *testing.T) {
	regions := map[string]doccheck.Region{
		"hi": {Name: "hi", File: "x.go", Line: 4, Text: "if ok {\n\tprintln(\"hi\")\n}\n"},
	}
	md := "intro\n<!-- snippet: hi -->\n```go\nold\n```\n\n- item\n  <!-- snippet: hi -->\n  ~~~go\n  ~~~\n" +
		"<!-- snippet: gone -->\n```\nx\n```\nend\n"
	want := "intro\n<!-- snippet: hi -->\n```go\nif ok {\n\tprintln(\"hi\")\n}\n```\n\n- item\n  <!-- snippet: hi -->\n" +
		"  ~~~go\n  if ok {\n  \tprintln(\"hi\")\n  }\n  ~~~\n<!-- snippet: gone -->\n```\nx\n```\nend\n"
	out, problems := doccheck.Snippets("README.md", []byte(md), regions, true)
	if string(out) != want {
		t.Fatalf("got\n%s\nwant\n%s", out, want)
	}
	if len(problems) != 1 || problems[0].String() != "README.md:11: unknown snippet gone" {
		t.Fatalf("problems %v", problems)
	}
	out, problems = doccheck.Snippets("README.md", out, regions, false)
	if out != nil || len(problems) != 1 {
		t.Fatalf("after the update: %q, %v", out, problems)
	}
}

// A region name defined twice, in two files, is a problem naming both.
func TestDuplicateRegion(t *testing.T) {
	src := []byte("// snippet:start a\nx\n// snippet:end a\n")
	_, problems := doccheck.CollectRegions(fstest.MapFS{"a.go": {Data: src}, "b/b.go": {Data: src},
		".hidden/c.go": {Data: src}, "testdata/d.go": {Data: src}})
	if len(problems) != 1 || problems[0].String() != "b/b.go:1: snippet a is also defined at a.go:1" {
		t.Fatalf("problems %v", problems)
	}
}
