package main

// The sequential specification Porcupine checks each partition against: a first-writer-wins register.
//
// A partition is one dispatch key of one tenant (every spawn with the key, every GET by the key or by
// the run id its answers named) or one keyless run id (the spawn that created or named it, GETs by
// it). Its state is absent, or the run written first: its request's fingerprint, and its run_id and
// created_at once an answer showed them (a write of unknown outcome leaves them to be learnt).

import (
	"fmt"
	"hash/fnv"

	"github.com/anishathalye/porcupine"
)

type register struct {
	present   bool
	fp        string // the first request's fingerprint
	runID     string // "" until an answer shows it
	createdAt string // "" until an answer shows it
}

type opKind int

const (
	spawnOp opKind = iota
	readOp
)

type input struct {
	kind      opKind
	fp        string // spawn: the request's fingerprint
	runID     string // read by id: the id asked for ("" for a read by key)
	partition string // the key or keyless run the operation is about (see check.go)
}

type outcome int

const (
	created     outcome = iota // 201
	replayed                   // 200 Idempotent-Replayed
	reused                     // 422 dispatch-key-reused, naming the run
	unavailable                // store-unavailable, internal-error: nothing was written
	unknown                    // no answer, outcome-unknown: it may or may not have taken effect
	found                      // a read's 200
	absent                     // a read's 404
)

type output struct {
	outcome   outcome
	runID     string // "" when the answer names none
	createdAt string
	fp        string // the fingerprint of the run the answer carries
}

// agrees is whether a known value is consistent with what an answer shows ("" is not yet known).
func agrees(known, shown string) bool {
	return known == "" || shown == "" || known == shown
}

// learnt is the register once an answer showed its run_id and created_at.
func (r register) learnt(out output) register {
	if r.runID == "" {
		r.runID = out.runID
	}
	if r.createdAt == "" {
		r.createdAt = out.createdAt
	}
	return r
}

func step(state, in, out interface{}) []interface{} {
	r, i, o := state.(register), in.(input), out.(output)
	none := []interface{}{}
	if i.kind == spawnOp {
		switch o.outcome {
		case created: // only when absent, and the run is this request's
			if r.present || o.fp != i.fp {
				return none
			}
			return []interface{}{register{true, i.fp, o.runID, o.createdAt}}
		case replayed: // exactly the first run, for the same request
			if !r.present || r.fp != i.fp || o.fp != i.fp || !agrees(r.runID, o.runID) || !agrees(r.createdAt, o.createdAt) {
				return none
			}
			return []interface{}{r.learnt(o)}
		case reused: // another request's run, named
			if !r.present || r.fp == i.fp || !agrees(r.runID, o.runID) {
				return none
			}
			return []interface{}{r.learnt(output{runID: o.runID})}
		case unavailable:
			return []interface{}{r}
		case unknown: // either nothing happened, or (if absent) this request's write landed
			if r.present {
				return []interface{}{r}
			}
			return []interface{}{r, register{true, i.fp, o.runID, ""}}
		}
		return none
	}
	switch o.outcome {
	case found:
		if !r.present || r.fp != o.fp || !agrees(r.runID, o.runID) || !agrees(r.createdAt, o.createdAt) {
			return none
		}
		if i.runID != "" && o.runID != i.runID {
			return none
		}
		return []interface{}{r.learnt(o)}
	case absent:
		// A read by id finds nothing when another run holds the key; while the run's id is unknown, it
		// may be another one (the register cannot hold "not this id": sound, if less strict).
		if !r.present || (i.runID != "" && r.runID != i.runID) {
			return []interface{}{r}
		}
		return none
	}
	return none
}

func hashRegister(state interface{}) uint64 {
	r := state.(register)
	h := fnv.New64a()
	fmt.Fprintf(h, "%t\x00%s\x00%s\x00%s", r.present, r.fp, r.runID, r.createdAt)
	return h.Sum64()
}

func short(id string) string {
	if len(id) > 8 {
		return id[:8] + "…"
	}
	if id == "" {
		return "?"
	}
	return id
}

var outcomeNames = map[outcome]string{
	created: "201", replayed: "200 replay", reused: "422 reused", unavailable: "store-unavailable",
	unknown: "unknown", found: "200", absent: "404",
}

func describeOperation(in, out interface{}) string {
	i, o := in.(input), out.(output)
	what := "spawn " + i.fp
	if i.kind == readOp {
		what = "get by key"
		if i.runID != "" {
			what = "get " + short(i.runID)
		}
	}
	answer := outcomeNames[o.outcome]
	if o.runID != "" {
		answer += " " + short(o.runID)
	}
	if o.createdAt != "" {
		answer += " @" + o.createdAt
	}
	return what + " → " + answer
}

func describeRegister(state interface{}) string {
	r := state.(register)
	if !r.present {
		return "absent"
	}
	createdAt := r.createdAt
	if createdAt == "" {
		createdAt = "?"
	}
	return fmt.Sprintf("run %s @%s of %s", short(r.runID), createdAt, r.fp)
}

func describeMetadata(info interface{}) string {
	if info == nil {
		return ""
	}
	return info.(string)
}

// model is the register's Porcupine model; partition, if given, splits a history by partition label.
func model(partition func([]porcupine.Operation) [][]porcupine.Operation) porcupine.Model {
	nondeterministic := porcupine.NondeterministicModel{
		Partition:                 partition,
		Init:                      func() []interface{} { return []interface{}{register{}} },
		Step:                      step,
		Hash:                      hashRegister,
		DescribeOperation:         describeOperation,
		DescribeState:             describeRegister,
		DescribeOperationMetadata: describeMetadata,
	}
	return nondeterministic.ToModel()
}
