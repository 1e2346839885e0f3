// Package doccheck keeps the repository's Markdown honest; its tests check README.md,
// CONTRIBUTING.md, CHANGELOG.md, FAULTS.md and docs/*.md against the code:
//
//   - Snippets. Code shown in the docs is taken from compiled, runnable examples. In Go source,
//     a region lies between a line `// snippet:start NAME` and a line `// snippet:end NAME`. In
//     README.md, CONTRIBUTING.md and docs/*.md, a fenced code block on the line right after
//     `<!-- snippet: NAME -->` must equal the region's text: its lines without the marker lines
//     (of any region), leading and trailing blank lines dropped, dedented by the indentation
//     common to its lines (tabs stay tabs, as gofmt writes them).
//     `go test ./internal/doccheck` names the file and line of every stale or unknown snippet;
//     `go test ./internal/doccheck -update` rewrites the blocks from the regions.
//   - Links. Every relative link (outside code) resolves to a file or directory of the
//     repository, and every #anchor, in the same file or another Markdown file, names a heading
//     there by GitHub's rules (see Slug) or an HTML id. http(s) and mailto links are not checked.
//
// The regions, all in package pool's examples (pool/example_*_test.go) unless said otherwise:
//
//   - embed-imports: the import block a main.go of the embedding example needs.
//   - embed-args: EmailArgs, a typed job argument naming its kind (Example_embed).
//   - embed-handler: sendEmail, a handler whose write is fenced and completes the job in the
//     same transaction.
//   - embed: runWorker: Migrate, New, AddWorker, InsertArgs, Run until ctx is cancelled.
//   - embed-main: main's part: signal.NotifyContext (a second signal ends the process),
//     pgxpool.New, runWorker (Example).
//   - embed-observer: a Config.Observer that hands events over without ever blocking.
//   - insert-tx: placeOrder, a business row and its job in one transaction; a failure rolls both
//     back (Example_insertTx).
//   - fenced: charge, Fence, the business write and CompleteTx in one transaction, an
//     insufficient balance failing the job permanently (Example_fenced).
//   - revoke-handler: a long handler that stops on lease.ErrRevoked (Example_revokeFromSQL).
//   - revoke-sql: SELECT leash.revoke_job(id, reason) from Go, with a note on a bare NOTIFY.
//   - unique: two inserts with one UniqueKey, the second a duplicate naming the first's id
//     (Example_unique).
//   - schedule: Config.Schedules with an @every spec (Example_schedule).
//   - schedule-sql: a schedule inserted into leash.schedules from SQL.
//   - pause-queue, resume-queue: PauseQueue and ResumeQueue (Example_pauseQueue).
//   - workflow: InsertWorkflow of four jobs, one of them MayFail (Example_workflow).
//   - fanout: a handler adding jobs to its own workflow with AddToWorkflowTx, then CompleteTx.
//   - dependency-outputs: Job.DependencyOutputs read by a join.
//   - pooltest-nodb, pooltest-db: pooltest.Work on a handler without and with a database
//     (pool/pooltest/example_test.go, ExampleWork).
//   - pooltest-main, pooltest-test: an application's TestMain with pooltest.Main, and a test of
//     a fenced handler on a database of its own from pooltest.Database
//     (pool/pooltest/pooltest_test.go).
package doccheck

import (
	"bytes"
	"fmt"
	"io/fs"
	"net/url"
	"path"
	"regexp"
	"sort"
	"strings"
	"unicode"
)

// Problem is one finding, at a line of a file (paths relative to the repository root).
type Problem struct {
	File string
	Line int
	Msg  string
}

func (p Problem) String() string { return fmt.Sprintf("%s:%d: %s", p.File, p.Line, p.Msg) }

// Region is the text of one snippet region of Go source.
type Region struct {
	Name string
	File string
	Line int // of its start marker
	Text string
}

var (
	regionMarker = regexp.MustCompile(`^\s*// snippet:(start|end)\s+(\S+)\s*$`)
	regionName   = regexp.MustCompile(`^[a-z0-9][a-z0-9-]*$`)
	snippetRef   = regexp.MustCompile(`^\s*<!-- snippet: (\S+) -->\s*$`)
	fenceOpen    = regexp.MustCompile("^(\\s*)(`{3,}|~{3,})(.*)$")
)

// ParseRegions reads the snippet regions of one Go file.
func ParseRegions(file string, src []byte) ([]Region, []Problem) {
	var regions []Region
	var problems []Problem
	type open struct {
		line  int
		lines []string
	}
	opened := map[string]*open{}
	for i, line := range strings.Split(string(src), "\n") {
		m := regionMarker.FindStringSubmatch(line)
		if m == nil {
			for _, o := range opened {
				o.lines = append(o.lines, line)
			}
			continue
		}
		name := m[2]
		switch o := opened[name]; {
		case !regionName.MatchString(name):
			problems = append(problems, Problem{file, i + 1, fmt.Sprintf("snippet name %q: use lower case letters, digits and -", name)})
		case m[1] == "start" && o != nil:
			problems = append(problems, Problem{file, i + 1, fmt.Sprintf("snippet %s starts again before it ended (line %d)", name, o.line)})
		case m[1] == "start":
			opened[name] = &open{line: i + 1}
		case o == nil:
			problems = append(problems, Problem{file, i + 1, fmt.Sprintf("snippet %s ends without a start", name)})
		default:
			delete(opened, name)
			text := dedent(o.lines)
			if text == "" {
				problems = append(problems, Problem{file, o.line, fmt.Sprintf("snippet %s is empty", name)})
				continue
			}
			regions = append(regions, Region{Name: name, File: file, Line: o.line, Text: text})
		}
	}
	for name, o := range opened {
		problems = append(problems, Problem{file, o.line, fmt.Sprintf("snippet %s has no end", name)})
	}
	sortProblems(problems)
	return regions, problems
}

// dedent drops leading and trailing blank lines and the indentation common to the other lines,
// and joins them with a newline after each.
func dedent(lines []string) string {
	for len(lines) > 0 && strings.TrimSpace(lines[0]) == "" {
		lines = lines[1:]
	}
	for len(lines) > 0 && strings.TrimSpace(lines[len(lines)-1]) == "" {
		lines = lines[:len(lines)-1]
	}
	prefix, first := "", true
	for _, l := range lines {
		if strings.TrimSpace(l) == "" {
			continue
		}
		indent := l[:len(l)-len(strings.TrimLeft(l, " \t"))]
		if first {
			prefix, first = indent, false
		}
		for !strings.HasPrefix(indent, prefix) {
			prefix = prefix[:len(prefix)-1]
		}
	}
	var b strings.Builder
	for _, l := range lines {
		if strings.TrimSpace(l) == "" {
			b.WriteString("\n")
			continue
		}
		b.WriteString(strings.TrimPrefix(l, prefix) + "\n")
	}
	return b.String()
}

// CollectRegions reads the regions of every .go file of fsys, skipping directories whose name
// starts with "." or is testdata or vendor. A name used twice is a problem.
func CollectRegions(fsys fs.FS) (map[string]Region, []Problem) {
	regions := map[string]Region{}
	var problems []Problem
	err := fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); p != "." && (strings.HasPrefix(n, ".") || n == "testdata" || n == "vendor") {
				return fs.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") {
			return nil
		}
		src, err := fs.ReadFile(fsys, p)
		if err != nil {
			return err
		}
		if !bytes.Contains(src, []byte("// snippet:")) {
			return nil
		}
		rs, ps := ParseRegions(p, src)
		problems = append(problems, ps...)
		for _, r := range rs {
			if old, ok := regions[r.Name]; ok {
				problems = append(problems, Problem{r.File, r.Line, fmt.Sprintf("snippet %s is also defined at %s:%d", r.Name, old.File, old.Line)})
				continue
			}
			regions[r.Name] = r
		}
		return nil
	})
	if err != nil {
		problems = append(problems, Problem{".", 0, err.Error()})
	}
	sortProblems(problems)
	return regions, problems
}

// SnippetFiles are the Markdown files whose snippet blocks are checked: README.md,
// CONTRIBUTING.md and docs/*.md, those that exist.
func SnippetFiles(fsys fs.FS) []string {
	return existing(fsys, []string{"README.md", "CONTRIBUTING.md"})
}

// LinkFiles are the Markdown files whose links are checked: README.md, CONTRIBUTING.md,
// CHANGELOG.md, FAULTS.md and docs/*.md, those that exist.
func LinkFiles(fsys fs.FS) []string {
	return existing(fsys, []string{"README.md", "CONTRIBUTING.md", "CHANGELOG.md", "FAULTS.md"})
}

func existing(fsys fs.FS, top []string) []string {
	var files []string
	for _, f := range top {
		if _, err := fs.Stat(fsys, f); err == nil {
			files = append(files, f)
		}
	}
	docs, _ := fs.Glob(fsys, "docs/*.md")
	return append(files, docs...)
}

// Snippets checks the snippet blocks of one Markdown file against regions. With update, it also
// returns the file with every known block rewritten from its region (unknown names stay
// problems); out is nil when nothing changed.
func Snippets(file string, md []byte, regions map[string]Region, update bool) (out []byte, problems []Problem) {
	lines := strings.Split(string(md), "\n")
	changed := false
	shift := 0 // lines added by updates so far, to report lines of md
	var fence fenceState
	for i := 0; i < len(lines); i++ {
		if fence.inside(lines[i]) {
			continue
		}
		m := snippetRef.FindStringSubmatch(lines[i])
		if m == nil {
			continue
		}
		name, at := m[1], i+1-shift
		r, ok := regions[name]
		if !ok {
			problems = append(problems, Problem{file, at, fmt.Sprintf("unknown snippet %s", name)})
		}
		if i+1 >= len(lines) || fenceOpen.FindStringSubmatch(lines[i+1]) == nil {
			problems = append(problems, Problem{file, at, fmt.Sprintf("snippet %s: the next line must open a fenced code block", name)})
			continue
		}
		open := fenceOpen.FindStringSubmatch(lines[i+1])
		var block fenceState
		block.inside(lines[i+1])
		end := i + 2 // the closing fence's line
		for ; end < len(lines); end++ {
			if block.inside(lines[end]); block.char == 0 {
				break
			}
		}
		if end >= len(lines) {
			problems = append(problems, Problem{file, at, fmt.Sprintf("snippet %s: its code block is not closed", name)})
			break
		}
		if !ok {
			i = end
			continue
		}
		want := indent(r.Text, open[1])
		got := strings.Join(lines[i+2:end], "\n")
		if end > i+2 {
			got += "\n"
		}
		if got != want {
			if update {
				repl := strings.Split(strings.TrimSuffix(want, "\n"), "\n")
				lines = append(lines[:i+2], append(repl, lines[end:]...)...)
				shift += i + 2 + len(repl) - end
				end = i + 2 + len(repl)
				changed = true
			} else {
				problems = append(problems, Problem{file, at, fmt.Sprintf("snippet %s is stale: it differs from %s:%d (go test ./internal/doccheck -update rewrites it)", name, r.File, r.Line)})
			}
		}
		i = end
	}
	if changed {
		out = []byte(strings.Join(lines, "\n"))
	}
	return out, problems
}

// indent prefixes every non-blank line of text with prefix.
func indent(text, prefix string) string {
	if prefix == "" {
		return text
	}
	lines := strings.SplitAfter(text, "\n")
	for i, l := range lines {
		if strings.TrimSpace(l) != "" {
			lines[i] = prefix + l
		}
	}
	return strings.Join(lines, "")
}

// fenceState follows fenced code blocks line by line.
type fenceState struct {
	char byte // 0 outside a block
	n    int
}

// inside reports whether line is part of a fenced code block (its fences included).
func (f *fenceState) inside(line string) bool {
	t := strings.TrimLeft(line, " \t")
	if f.char == 0 {
		m := fenceOpen.FindStringSubmatch(line)
		if m == nil || (m[2][0] == '`' && strings.Contains(m[3], "`")) {
			return false
		}
		f.char, f.n = m[2][0], len(m[2])
		return true
	}
	run := len(t) - len(strings.TrimLeft(t, string(f.char)))
	if run >= f.n && strings.TrimSpace(t[run:]) == "" {
		f.char = 0
	}
	return true
}

// Slug is the anchor GitHub gives a heading's text: lower case, every character that is not a
// letter, a mark, a digit, a connector (_), a space or a hyphen removed, each space a hyphen.
// Markup is read as GitHub renders it: code spans and emphasis marks drop their markers, links
// and images their targets, HTML tags vanish. Duplicates are numbered by Anchors.
func Slug(heading string) string {
	s := htmlTag.ReplaceAllString(heading, "")
	s = inlineLink.ReplaceAllString(s, "$1")
	s = strings.NewReplacer("`", "", "*", "").Replace(s)
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(s)) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || unicode.In(r, unicode.L, unicode.M, unicode.N, unicode.Pc):
			b.WriteRune(r)
		}
	}
	return b.String()
}

var (
	atxHeading  = regexp.MustCompile(`^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$`)
	setextLine  = regexp.MustCompile(`^ {0,3}(=+|-+)[ \t]*$`)
	htmlTag     = regexp.MustCompile(`<[^>]*>`)
	htmlID      = regexp.MustCompile(`<[a-zA-Z][^>]*\s(?:id|name)="([^"]+)"`)
	inlineLink  = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	orderedItem = regexp.MustCompile(`^\d+[.)] `)
	refDef      = regexp.MustCompile(`^ {0,3}\[[^\]]+\]:[ \t]*<?([^\s>]+)>?`)
)

// Anchors returns the anchors of a Markdown file: its headings' slugs (a repeated slug gets -1,
// -2, ... as on GitHub) and the ids and names of its HTML elements. Headings in code blocks do
// not count.
func Anchors(md []byte) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	add := func(text string) {
		slug := Slug(text)
		if n := seen[slug]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", slug, n)] = true
		} else {
			anchors[slug] = true
		}
		seen[slug]++
	}
	var fence fenceState
	prev := ""
	for _, line := range strings.Split(string(md), "\n") {
		if fence.inside(line) {
			prev = ""
			continue
		}
		for _, m := range htmlID.FindAllStringSubmatch(line, -1) {
			anchors[m[1]] = true
		}
		if m := atxHeading.FindStringSubmatch(line); m != nil {
			add(m[2])
			prev = ""
			continue
		}
		if setextLine.MatchString(line) && isParagraph(prev) {
			add(prev)
			prev = ""
			continue
		}
		prev = line
	}
	return anchors
}

// isParagraph reports whether line can be the text of a setext heading: plain text, not a
// list item, quote, table row or HTML.
func isParagraph(line string) bool {
	t := strings.TrimSpace(line)
	if t == "" || strings.HasPrefix(line, "    ") || strings.HasPrefix(line, "\t") {
		return false
	}
	for _, p := range []string{"- ", "* ", "+ ", ">", "|", "<", "#"} {
		if strings.HasPrefix(t, p) {
			return false
		}
	}
	return !orderedItem.MatchString(t)
}

// Link is a link target found in a Markdown file.
type Link struct {
	Line   int
	Target string
}

// Links returns the link targets of a Markdown file outside code blocks and code spans: inline
// links and images ([text](target), with an optional title) and reference definitions.
func Links(md []byte) []Link {
	var links []Link
	var fence fenceState
	for i, line := range strings.Split(string(md), "\n") {
		if fence.inside(line) {
			continue
		}
		line = stripCodeSpans(line)
		if m := refDef.FindStringSubmatch(line); m != nil {
			links = append(links, Link{i + 1, m[1]})
			continue
		}
		for rest := line; ; {
			k := strings.Index(rest, "](")
			if k < 0 {
				break
			}
			rest = rest[k+2:]
			if t := linkTarget(rest); t != "" {
				links = append(links, Link{i + 1, t})
			}
		}
	}
	return links
}

// linkTarget reads the destination at the start of s, what follows "](".
func linkTarget(s string) string {
	s = strings.TrimLeft(s, " ")
	if strings.HasPrefix(s, "<") {
		if end := strings.IndexByte(s, '>'); end > 0 {
			return s[1:end]
		}
		return ""
	}
	depth := 0
	for i, r := range s {
		switch {
		case r == '(':
			depth++
		case r == ')' && depth == 0, r == ' ':
			return s[:i]
		case r == ')':
			depth--
		}
	}
	return ""
}

// stripCodeSpans removes the code spans of a line, markers and content.
func stripCodeSpans(line string) string {
	var b strings.Builder
	for {
		k := strings.IndexByte(line, '`')
		if k < 0 {
			b.WriteString(line)
			return b.String()
		}
		b.WriteString(line[:k])
		n := len(line[k:]) - len(strings.TrimLeft(line[k:], "`"))
		marker, rest := line[k:k+n], line[k+n:]
		end := -1
		for off := 0; ; {
			j := strings.Index(rest[off:], marker)
			if j < 0 {
				break
			}
			j += off
			if j+n == len(rest) || rest[j+n] != '`' {
				end = j
				break
			}
			off = j + n + len(rest[j+n:]) - len(strings.TrimLeft(rest[j+n:], "`"))
		}
		if end < 0 { // no closing run: the backticks are literal
			b.WriteString(marker)
			line = rest
			continue
		}
		line = rest[end+n:]
	}
}

// CheckLinks checks the relative links of the Markdown files of fsys named in files: each
// target exists in fsys (relative to the linking file, or to the root when it starts with /),
// and a #anchor into a Markdown file names one of its Anchors.
func CheckLinks(fsys fs.FS, files []string) []Problem {
	var problems []Problem
	anchors := map[string]map[string]bool{}
	anchorsOf := func(file string) (map[string]bool, error) {
		if a, ok := anchors[file]; ok {
			return a, nil
		}
		md, err := fs.ReadFile(fsys, file)
		if err != nil {
			return nil, err
		}
		anchors[file] = Anchors(md)
		return anchors[file], nil
	}
	for _, file := range files {
		md, err := fs.ReadFile(fsys, file)
		if err != nil {
			problems = append(problems, Problem{file, 0, err.Error()})
			continue
		}
		for _, l := range Links(md) {
			if p := checkLink(fsys, file, l.Target, anchorsOf); p != "" {
				problems = append(problems, Problem{file, l.Line, p})
			}
		}
	}
	sortProblems(problems)
	return problems
}

var scheme = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)

// checkLink says what is wrong with one link target of file, "" when nothing.
func checkLink(fsys fs.FS, file, target string, anchorsOf func(string) (map[string]bool, error)) string {
	if scheme.MatchString(target) || strings.HasPrefix(target, "//") {
		return "" // http(s), mailto and other absolute URLs are not checked
	}
	p, frag, _ := strings.Cut(target, "#")
	if i := strings.IndexByte(p, '?'); i >= 0 {
		p = p[:i]
	}
	p, err := url.PathUnescape(p)
	if err != nil {
		return fmt.Sprintf("link %s: %v", target, err)
	}
	dest := file
	if p != "" {
		if strings.HasPrefix(p, "/") {
			dest = path.Clean(strings.TrimPrefix(p, "/"))
		} else {
			dest = path.Join(path.Dir(file), p)
		}
		if dest == ".." || strings.HasPrefix(dest, "../") {
			return fmt.Sprintf("link %s leaves the repository", target)
		}
		if _, err := fs.Stat(fsys, dest); err != nil {
			return fmt.Sprintf("link %s: no file %s", target, dest)
		}
	}
	if frag == "" || !strings.HasSuffix(dest, ".md") {
		return ""
	}
	frag, err = url.PathUnescape(frag)
	if err != nil {
		return fmt.Sprintf("link %s: %v", target, err)
	}
	a, err := anchorsOf(dest)
	if err != nil {
		return fmt.Sprintf("link %s: %v", target, err)
	}
	if !a[frag] {
		return fmt.Sprintf("link %s: no heading of %s has anchor #%s", target, dest, frag)
	}
	return ""
}

func sortProblems(ps []Problem) {
	sort.SliceStable(ps, func(i, j int) bool {
		if ps[i].File != ps[j].File {
			return ps[i].File < ps[j].File
		}
		return ps[i].Line < ps[j].Line
	})
}
