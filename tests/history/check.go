package main

// From a history to Porcupine's operations per partition, and the checks that are not linearizability:
// what each answer may be, the final scan's counts (every stored run admitted, one run per key, every
// answered run stored in its tenant, every keyless run the write of one request of its marker: the run an
// answer named, or one run of a request whose outcome is unknown and which named none, that request's).

import (
	"encoding/json"
	"fmt"
	"math"
	"runtime"
	"sort"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// Never: the return time of an operation whose outcome is unknown (Jepsen's treatment: it may take
// effect at any point after its call, or never).
const Never = math.MaxInt64

// Failure is one violation, named by the check that found it and the key (partition) it is about.
type Failure struct {
	Check  string `json:"check"`
	Key    string `json:"key"`
	Detail string `json:"detail"`
	Ops    []int  `json:"ops,omitempty"` // ids of the operations involved
}

// Report is the checker's answer; tests/history/check.py reads it.
type Report struct {
	OK             bool           `json:"ok"`
	Ops            int            `json:"ops"`           // sent operations
	NotSent        int            `json:"not_sent"`      // refused connections: nothing reached the server
	Indeterminate  int            `json:"indeterminate"` // spawns whose outcome is unknown
	ReadsNoAnswer  int            `json:"reads_without_answer"`
	Answers        map[string]int `json:"answers"` // per f and answer: "spawn 201", "get-key 404", ...
	Keys           int            `json:"keys"`    // keyed partitions (tenant/dispatch_key)
	KeylessRuns    int            `json:"keyless_runs"`
	Partitions     int            `json:"partitions"`
	ScannedRuns    int            `json:"scanned_runs"`
	Fences         int            `json:"fences"`
	CheckerSeconds float64        `json:"checker_seconds"`
	Failures       []Failure      `json:"failures"`
	Visualization  string         `json:"visualization,omitempty"`
}

type partition struct {
	label string
	runID string // a keyless run's partition: its id ("" for a key's)
	ops   []porcupine.Operation
	ids   []int // the operations' ids, -1 for the final scan's read
}

type checker struct {
	history    *History
	report     *Report
	partitions map[string]*partition
	clients    int
	// keyless accounting per marker: its requests' answers, and the runs the scan holds
	keyless map[string]*keylessCount
	// every run an answer named as stored (201, 200, 422, GET 200): id → the op that named it
	answered map[string]*Op
}

// keylessCount is what the requests of one marker may have written. A 201 wrote the run it names; an
// outcome-unknown naming run X wrote X or nothing (its caller GETs X, and on a 404 sends again); a request
// with no answer, or an answer that is not the function's, may have written one run no answer names.
// Anything else wrote nothing.
type keylessCount struct {
	created, unknown int
	named            map[string]bool // the runs its 201s and outcome-unknown answers named
	anonymous        int             // unknown outcomes naming no run
	requests         map[string]bool // the (tenant, fingerprint) of each such request: what its run must be
	stored           []Run           // the runs of the marker the scan holds
	ops              []int
}

func keyLabel(tenant, key string) string   { return tenant + "/" + key }
func runLabel(tenant, runID string) string { return "run:" + tenant + "/" + runID }

func (c *checker) fail(check, key, detail string, ops ...int) {
	c.report.Failures = append(c.report.Failures, Failure{check, key, detail, ops})
}

func (c *checker) add(label, runID string, op porcupine.Operation, id int) {
	in := op.Input.(input)
	in.partition = label
	op.Input = in
	p, ok := c.partitions[label]
	if !ok {
		p = &partition{label: label, runID: runID}
		c.partitions[label] = p
	}
	p.ops = append(p.ops, op)
	p.ids = append(p.ids, id)
}

// answer is what a sent operation's answer means for the model, or false if it must not be checked.
func (c *checker) answer(op *Op) (output, bool) {
	if op.Return == nil || op.Status == nil {
		return output{outcome: unknown}, true
	}
	status, problem := *op.Status, ""
	if op.Problem != nil {
		problem = *op.Problem
	}
	named := ""
	if op.Named != nil {
		named = *op.Named
	}
	label := fmt.Sprintf("%s %d", op.F, status)
	if problem != "" {
		label += " " + problem
	}
	c.report.Answers[label]++
	withRun := func(kind outcome) (output, bool) {
		var run Run
		if err := json.Unmarshal(op.Run, &run); err != nil || run.RunID == "" {
			c.fail("answer", c.labelOf(op), fmt.Sprintf("op %d: %d without a run", op.ID, status), op.ID)
			return output{}, false
		}
		fp, err := run.fingerprint()
		if err != nil {
			c.fail("answer", c.labelOf(op), fmt.Sprintf("op %d: %v", op.ID, err), op.ID)
			return output{}, false
		}
		if run.TenantID != op.Tenant || !sameKey(run.DispatchKey, op.Key) || run.Status != "admitted" {
			c.fail("answer", c.labelOf(op), fmt.Sprintf("op %d: the run %s is not this request's (tenant %q, "+
				"dispatch_key %v, status %q)", op.ID, run.RunID, run.TenantID, deref(run.DispatchKey), run.Status), op.ID)
		}
		c.answered[run.RunID] = op
		return output{kind, run.RunID, run.CreatedAt, fp}, true
	}
	switch {
	case op.F == "spawn" && status == 201:
		return withRun(created)
	case op.F == "spawn" && status == 200 && op.Key != nil:
		if !op.Replay {
			c.fail("answer", c.labelOf(op), fmt.Sprintf("op %d: 200 without Idempotent-Replayed: true", op.ID), op.ID)
		}
		return withRun(replayed)
	case op.F == "spawn" && status == 422 && problem == "dispatch-key-reused" && op.Key != nil && named != "":
		c.answered[named] = op
		return output{outcome: reused, runID: named}, true
	case op.F == "spawn" && status == 503 && problem == "store-unavailable":
		return output{outcome: unavailable}, true
	case op.F == "spawn" && status == 500 && problem == "internal-error": // documented: no run was written
		return output{outcome: unavailable}, true
	case op.F == "spawn" && status == 503 && problem == "outcome-unknown" && named != "":
		return output{outcome: unknown, runID: named}, true
	case op.F != "spawn" && status == 200:
		return withRun(found)
	case op.F != "spawn" && status == 404 && problem == "run-not-found":
		return output{outcome: absent}, true
	case op.F != "spawn" && status == 503 && problem == "store-unavailable":
		return output{}, false // a read that failed says nothing
	case status >= 500 && problem == "":
		// Not the function's answer (the local API's own 502, say): the request may have run.
		if op.F == "spawn" {
			return output{outcome: unknown}, true
		}
		return output{}, false
	}
	c.fail("answer", c.labelOf(op), fmt.Sprintf("op %d: %s answered %d %s, which the contract does not allow",
		op.ID, op.F, status, problem), op.ID)
	return output{}, false
}

func sameKey(a, b *string) bool {
	return (a == nil && b == nil) || (a != nil && b != nil && *a == *b)
}

func deref(s *string) interface{} {
	if s == nil {
		return nil
	}
	return *s
}

func text(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// labelOf is the partition an operation belongs to: its key's, or (keyless) its run id's.
func (c *checker) labelOf(op *Op) string {
	if op.Key != nil {
		return keyLabel(op.Tenant, *op.Key)
	}
	if op.RunID != nil {
		return runLabel(op.Tenant, *op.RunID)
	}
	if op.Marker != nil {
		return "marker:" + *op.Marker
	}
	return "?"
}

func (c *checker) operations() {
	for index := range c.history.Ops {
		op := &c.history.Ops[index]
		if op.Client >= c.clients {
			c.clients = op.Client + 1
		}
		if !op.Sent {
			c.report.NotSent++
			continue
		}
		c.report.Ops++
		out, checked := c.answer(op)
		if op.F != "spawn" {
			if !checked || out.outcome == unknown {
				c.report.ReadsNoAnswer++
				continue
			}
			in := input{kind: readOp}
			runID := ""
			if op.F == "get-id" {
				in.runID = text(op.RunID)
				if op.Key == nil {
					runID = in.runID
				}
			}
			c.add(c.labelOf(op), runID, c.operation(op, in, out), op.ID)
			continue
		}
		if out.outcome == unknown {
			c.report.Indeterminate++
		}
		if !checked {
			continue
		}
		fp, err := op.requestFingerprint()
		if err != nil {
			c.fail("answer", c.labelOf(op), fmt.Sprintf("op %d: %v", op.ID, err), op.ID)
			continue
		}
		in := input{kind: spawnOp, fp: fp}
		if op.Key != nil {
			c.add(keyLabel(op.Tenant, *op.Key), "", c.operation(op, in, out), op.ID)
			continue
		}
		marker := text(op.Marker)
		count := c.keyless[marker]
		if count == nil {
			count = &keylessCount{named: map[string]bool{}, requests: map[string]bool{}}
			c.keyless[marker] = count
		}
		count.ops = append(count.ops, op.ID)
		switch out.outcome {
		case created:
			count.created++
		case unknown:
			count.unknown++
		}
		switch {
		case out.runID != "":
			count.named[out.runID] = true
		case out.outcome == unknown:
			count.anonymous++
			count.requests[op.Tenant+"\x00"+fp] = true
		}
		if out.runID != "" { // 201, or outcome-unknown naming the run: its own register
			c.add(runLabel(op.Tenant, out.runID), out.runID, c.operation(op, in, out), op.ID)
		}
	}
}

func (c *checker) operation(op *Op, in input, out output) porcupine.Operation {
	end := int64(Never)
	if out.outcome != unknown && op.Return != nil {
		end = *op.Return
	}
	detail := fmt.Sprintf("op %d, client %d, %s", op.ID, op.Client, op.F)
	if op.Via != "" {
		detail += " (key in " + op.Via + ")"
	}
	if op.Error != nil {
		detail += ": " + *op.Error
	}
	return porcupine.Operation{ClientId: op.Client, Input: in, Call: op.Call, Output: out, Return: end, Metadata: detail}
}

// scan checks the table's final state and adds it to every partition as a last read.
func (c *checker) scan() {
	scan := c.history.Scan
	c.report.ScannedRuns = len(scan.Runs)
	c.report.Fences = scan.Fences
	byKey := map[string][]Run{}
	byRun := map[string]Run{} // by runLabel: a run is found in its own tenant only
	for _, run := range scan.Runs {
		byRun[runLabel(run.TenantID, run.RunID)] = run
		if run.Status != "admitted" { // the only status admission writes; a run is never modified otherwise
			label := runLabel(run.TenantID, run.RunID)
			if run.DispatchKey != nil {
				label = keyLabel(run.TenantID, *run.DispatchKey)
			}
			c.fail("stored-run", label, fmt.Sprintf("run %s has status %q, not admitted", run.RunID, run.Status))
		}
		if run.DispatchKey != nil {
			label := keyLabel(run.TenantID, *run.DispatchKey)
			byKey[label] = append(byKey[label], run)
			if _, known := c.partitions[label]; !known {
				c.fail("unexplained-run", label, fmt.Sprintf("run %s of a key no operation used", run.RunID))
			}
			continue
		}
		marker := run.marker()
		count := c.keyless[marker]
		if marker == "" || count == nil {
			c.fail("unexplained-run", runLabel(run.TenantID, run.RunID), "a keyless run of no request of this history")
			continue
		}
		count.stored = append(count.stored, run)
	}
	for label, runs := range byKey {
		if len(runs) > 1 {
			ids := []string{}
			for _, run := range runs {
				ids = append(ids, run.RunID)
			}
			c.fail("one-run-per-key", label, fmt.Sprintf("%d runs: %v", len(runs), ids))
		}
	}
	for runID, op := range c.answered {
		if _, stored := byRun[runLabel(op.Tenant, runID)]; !stored {
			label := c.labelOf(op)
			if op.Key == nil {
				label = runLabel(op.Tenant, runID)
			}
			c.fail("answered-run-exists", label, fmt.Sprintf("run %s, answered by op %d, is not in its tenant's table",
				runID, op.ID), op.ID)
		}
	}
	markers := make([]string, 0, len(c.keyless))
	for marker := range c.keyless {
		markers = append(markers, marker)
	}
	sort.Strings(markers)
	for _, marker := range markers {
		count := c.keyless[marker]
		// A run an answer named is that request's write (its partition checks when, and what); each other run
		// needs a request of unknown outcome that named none, and is that request's (its tenant, workflow_ref,
		// input and goal_id): no partition checks it. An outcome-unknown naming X explains X, never another run.
		unnamed, unlike := []string{}, []string{}
		for _, run := range count.stored {
			if count.named[run.RunID] {
				continue
			}
			unnamed = append(unnamed, run.RunID)
			if fp, err := run.fingerprint(); err != nil || !count.requests[run.TenantID+"\x00"+fp] {
				unlike = append(unlike, run.RunID)
			}
		}
		if len(unnamed) > count.anonymous {
			c.fail("keyless-runs", "marker:"+marker, fmt.Sprintf("%d runs stored for %d 201s and %d unknown answers "+
				"(%d naming no run); runs no answer named: %v", len(count.stored), count.created, count.unknown,
				count.anonymous, unnamed), count.ops...)
		}
		if len(unlike) > 0 {
			c.fail("keyless-runs", "marker:"+marker, fmt.Sprintf("runs no answer named, of no request of the marker "+
				"whose outcome is unknown (its tenant, workflow_ref, input, goal_id): %v", unlike), count.ops...)
		}
	}
	final := input{kind: readOp}
	for label, p := range c.partitions {
		out := output{outcome: absent}
		var run *Run
		if runs := byKey[label]; len(runs) > 0 {
			run = &runs[0]
		} else if stored, ok := byRun[label]; ok && p.runID != "" {
			run = &stored
		}
		in := final
		if run != nil {
			fp, err := run.fingerprint()
			if err != nil {
				c.fail("answer", label, fmt.Sprintf("stored run %s: %v", run.RunID, err))
				continue
			}
			out = output{found, run.RunID, run.CreatedAt, fp}
		}
		in.runID = p.runID
		in.partition = label
		p.ops = append(p.ops, porcupine.Operation{
			ClientId: c.clients, Input: in, Call: scan.At, Output: out, Return: scan.At + 1, Metadata: "the final scan",
		})
		p.ids = append(p.ids, -1)
	}
}

// linearizable checks every partition with Porcupine, in parallel; the labels that are not.
func (c *checker) linearizable(timeout time.Duration) []string {
	labels := make([]string, 0, len(c.partitions))
	for label := range c.partitions {
		labels = append(labels, label)
	}
	sort.Strings(labels)
	results := make([]porcupine.CheckResult, len(labels))
	single := model(nil)
	var group sync.WaitGroup
	work := make(chan int)
	for w := 0; w < runtime.GOMAXPROCS(0); w++ {
		group.Add(1)
		go func() {
			defer group.Done()
			for i := range work {
				results[i] = porcupine.CheckOperationsTimeout(single, c.partitions[labels[i]].ops, timeout)
			}
		}()
	}
	for i := range labels {
		work <- i
	}
	close(work)
	group.Wait()
	var failed []string
	for i, label := range labels {
		switch results[i] {
		case porcupine.Illegal:
			failed = append(failed, label)
			c.fail("linearizable", label, "no order of its operations agrees with a first-writer-wins register",
				c.partitions[label].opIDs()...)
		case porcupine.Unknown:
			failed = append(failed, label)
			c.fail("inconclusive", label, fmt.Sprintf("Porcupine did not decide within %s", timeout))
		}
	}
	return failed
}

func (p *partition) opIDs() []int {
	ids := []int{}
	for _, id := range p.ids {
		if id >= 0 {
			ids = append(ids, id)
		}
	}
	return ids
}

// visualize writes Porcupine's HTML visualization of the given partitions, with the nemesis's events.
func (c *checker) visualize(labels []string, path string, timeout time.Duration) error {
	var ops []porcupine.Operation
	index := map[string]int{}
	for i, label := range labels {
		index[label] = i
		ops = append(ops, c.partitions[label].ops...)
	}
	byLabel := func(history []porcupine.Operation) [][]porcupine.Operation {
		parts := make([][]porcupine.Operation, len(labels))
		for _, op := range history {
			i := index[op.Input.(input).partition]
			parts[i] = append(parts[i], op)
		}
		return parts
	}
	m := model(byLabel)
	_, info := porcupine.CheckOperationsVerbose(m, ops, timeout)
	annotations := []porcupine.Annotation{}
	for _, event := range c.history.Events {
		annotations = append(annotations, porcupine.Annotation{
			Tag: "nemesis", Start: event.Start, End: event.End, Description: event.What, Details: event.Detail,
			BackgroundColor: "#fde2e2",
		})
	}
	for i, label := range labels {
		annotations = append(annotations, porcupine.Annotation{
			Tag: "partitions", Start: c.partitions[label].ops[0].Call, Description: fmt.Sprintf("%d: %s", i, label),
		})
	}
	info.AddAnnotations(annotations)
	return porcupine.VisualizePath(m, info, path)
}

func check(history *History, visualization string, timeout time.Duration) *Report {
	started := time.Now()
	c := &checker{
		history:    history,
		report:     &Report{Answers: map[string]int{}, Failures: []Failure{}},
		partitions: map[string]*partition{},
		keyless:    map[string]*keylessCount{},
		answered:   map[string]*Op{},
	}
	c.operations()
	c.scan()
	for label := range c.partitions {
		if label[:4] == "run:" {
			c.report.KeylessRuns++
		} else {
			c.report.Keys++
		}
	}
	c.report.Partitions = len(c.partitions)
	failed := c.linearizable(timeout)
	// Every partition a failure names, linearizable or not, is drawn: the reader sees its operations.
	drawn := map[string]bool{}
	for _, label := range failed {
		drawn[label] = true
	}
	for _, failure := range c.report.Failures {
		if _, ok := c.partitions[failure.Key]; ok {
			drawn[failure.Key] = true
		}
	}
	c.report.OK = len(c.report.Failures) == 0
	if !c.report.OK && visualization != "" && len(drawn) > 0 {
		labels := make([]string, 0, len(drawn))
		for label := range drawn {
			labels = append(labels, label)
		}
		sort.Strings(labels)
		if err := c.visualize(labels, visualization, timeout); err != nil {
			c.fail("visualization", "", err.Error())
		} else {
			c.report.Visualization = visualization
		}
	}
	c.report.CheckerSeconds = time.Since(started).Seconds()
	return c.report
}
