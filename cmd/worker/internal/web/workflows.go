package web

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/leashq/leash/pool"
)

// Flash codes of the workflow page.
const (
	flashWorkflowRevoked = "workflow-revoked"
)

// maxGraphNodes bounds the jobs the workflow page draws; larger workflows are listed only.
const maxGraphNodes = 300

// workflowListLimit bounds the jobs the workflow page lists.
const workflowListLimit = 2000

// graphNode is one job drawn in the workflow graph.
type graphNode struct {
	pool.WorkflowStep
	X, Y  int
	Label string
}

// graphEdge is a dependency drawn from the dependency (X1, Y1) to the job waiting for it.
type graphEdge struct{ X1, Y1, X2, Y2 int }

// workflowGraph is the server-rendered SVG of a workflow: nodes laid out in columns by depth
// (the longest chain of dependencies before them), edges as lines.
type workflowGraph struct {
	Width, Height int
	Nodes         []graphNode
	Edges         []graphEdge
}

const (
	nodeW, nodeH = 150, 28
	colGap       = 60
	rowGap       = 14
	margin       = 10
)

// layout draws steps: columns by depth, rows in id order within a column. Dependencies on
// steps not shown (beyond the list's limit) are left out.
func layout(steps []pool.WorkflowStep) workflowGraph {
	pos := make(map[string]int, len(steps))
	for i, s := range steps {
		pos[s.Step] = i
	}
	// Depths by Kahn's algorithm; a step on a cycle (refused by the database) stays at 0.
	depth := make([]int, len(steps))
	indeg := make([]int, len(steps))
	next := make([][]int, len(steps))
	for i, s := range steps {
		for _, d := range s.DependsOn {
			if k, ok := pos[d]; ok {
				indeg[i]++
				next[k] = append(next[k], i)
			}
		}
	}
	var queue []int
	for i, n := range indeg {
		if n == 0 {
			queue = append(queue, i)
		}
	}
	for h := 0; h < len(queue); h++ {
		i := queue[h]
		for _, k := range next[i] {
			depth[k] = max(depth[k], depth[i]+1)
			if indeg[k]--; indeg[k] == 0 {
				queue = append(queue, k)
			}
		}
	}
	rows := map[int]int{}
	g := workflowGraph{}
	maxRow, maxCol := 0, 0
	for i, s := range steps {
		col, row := depth[i], rows[depth[i]]
		rows[col]++
		maxRow, maxCol = max(maxRow, row), max(maxCol, col)
		label := s.Step
		if r := []rune(label); len(r) > 20 {
			label = string(r[:19]) + "…"
		}
		g.Nodes = append(g.Nodes, graphNode{WorkflowStep: s, Label: label,
			X: margin + col*(nodeW+colGap), Y: margin + row*(nodeH+rowGap)})
	}
	for i, s := range steps {
		for _, d := range s.DependsOn {
			if k, ok := pos[d]; ok {
				a, b := g.Nodes[k], g.Nodes[i]
				g.Edges = append(g.Edges, graphEdge{X1: a.X + nodeW, Y1: a.Y + nodeH/2, X2: b.X, Y2: b.Y + nodeH/2})
			}
		}
	}
	g.Width = 2*margin + (maxCol+1)*nodeW + maxCol*colGap
	g.Height = 2*margin + (maxRow+1)*nodeH + maxRow*rowGap
	return g
}

func (s *server) workflow(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		http.Error(w, "bad workflow id", http.StatusBadRequest)
		return
	}
	wf, err := pool.GetWorkflow(r.Context(), s.DB, id, workflowListLimit)
	if errors.Is(err, pool.ErrWorkflowNotFound) {
		http.Error(w, fmt.Sprintf("workflow %d not found", id), http.StatusNotFound)
		return
	}
	if err != nil {
		s.fail(w, err)
		return
	}
	var graph *workflowGraph
	if len(wf.Steps) <= maxGraphNodes {
		g := layout(wf.Steps)
		graph = &g
	}
	unfinished, counts := 0, map[string]int{}
	for _, st := range wf.Steps {
		counts[st.State]++
		switch st.State {
		case pool.StateCompleted, pool.StateFailed, pool.StateCancelled:
		default:
			unfinished++
		}
	}
	var flash string
	if r.URL.Query().Get("flash") == flashWorkflowRevoked {
		n, _ := strconv.Atoi(r.URL.Query().Get("n"))
		flash = fmt.Sprintf("Workflow %d revoked: %d unfinished job(s).", id, max(n, 0))
	}
	var summary []string
	for _, st := range pool.States() {
		if counts[st] > 0 {
			summary = append(summary, fmt.Sprintf("%d %s", counts[st], st))
		}
	}
	s.render(w, "workflow.html", struct {
		Workflow   pool.WorkflowInfo
		Graph      *workflowGraph
		Summary    string
		Unfinished int
		Truncated  bool
		Flash      string
		Refresh    int
		MaxNodes   int
	}{wf, graph, strings.Join(summary, ", "), unfinished, len(wf.Steps) == workflowListLimit, flash,
		int(s.Refresh.Seconds()), maxGraphNodes})
}

func (s *server) revokeWorkflow(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		http.Error(w, "bad workflow id", http.StatusBadRequest)
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		http.Error(w, "bad form", http.StatusBadRequest)
		return
	}
	reason := strings.TrimSpace(r.PostFormValue("reason"))
	if reason == "" {
		reason = "workflow revoked from the admin page"
	}
	n, err := pool.RevokeWorkflow(r.Context(), s.DB, id, reason)
	if err != nil {
		s.fail(w, err)
		return
	}
	http.Redirect(w, r, fmt.Sprintf("/workflows/%d?flash=%s&n=%d", id, flashWorkflowRevoked, n), http.StatusSeeOther)
}
