package main

// Reading a history file: JSON lines written by tests/history/history.py (its module doc describes them).

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
)

// Op is one operation a client sent: a spawn (POST /v1/runs), a GET by key or a GET by id.
type Op struct {
	ID      int             `json:"id"`
	Client  int             `json:"client"`
	F       string          `json:"f"` // "spawn", "get-key", "get-id"
	Tenant  string          `json:"tenant"`
	Key     *string         `json:"key"`    // the dispatch key (spawn, get-key; get-id of a keyed run)
	Via     string          `json:"via"`    // how a spawn carried its key: "body" or "header"
	Marker  *string         `json:"marker"` // a keyless spawn's unique marker (also in its input)
	Request json.RawMessage `json:"request"`
	RunID   *string         `json:"run_id"` // get-id: the id asked for
	Call    int64           `json:"call"`
	Return  *int64          `json:"return"` // nil: no answer (timeout, connection lost, poimen dev killed)
	Sent    bool            `json:"sent"`   // false: the connection was refused, nothing reached the server
	Status  *int            `json:"status"`
	Problem *string         `json:"problem"` // problem+json type without urn:poimen:problem:
	Named   *string         `json:"named"`   // the run_id a problem names (422, outcome-unknown)
	Replay  bool            `json:"replayed"`
	Run     json.RawMessage `json:"run"` // the run an answer carries (201, 200)
	Error   *string         `json:"error"`
}

// Event is something the nemesis did (a fault window, a kill), shown on the visualization.
type Event struct {
	What   string `json:"what"`
	Start  int64  `json:"start"`
	End    int64  `json:"end"`
	Detail string `json:"detail"`
}

// Run is a run as an answer or the final scan carries it.
type Run struct {
	RunID       string          `json:"run_id"`
	TenantID    string          `json:"tenant_id"`
	WorkflowRef string          `json:"workflow_ref"`
	Input       json.RawMessage `json:"input"`
	GoalID      *string         `json:"goal_id"`
	DispatchKey *string         `json:"dispatch_key"`
	Status      string          `json:"status"`
	CreatedAt   string          `json:"created_at"`
}

// Scan is the final consistent scan of the table, taken once nothing could write any more.
type Scan struct {
	At     int64 `json:"at"`
	Runs   []Run `json:"runs"`
	Fences int   `json:"fences"`
}

type History struct {
	Ops    []Op
	Events []Event
	Scan   *Scan
}

func readHistory(path string) (*History, error) {
	file, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer file.Close()
	return parseHistory(file)
}

func parseHistory(r io.Reader) (*History, error) {
	history := &History{}
	lines := bufio.NewScanner(r)
	lines.Buffer(make([]byte, 1<<20), 64<<20)
	number := 0
	for lines.Scan() {
		number++
		line := bytes.TrimSpace(lines.Bytes())
		if len(line) == 0 {
			continue
		}
		var head struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(line, &head); err != nil {
			return nil, fmt.Errorf("line %d: %w", number, err)
		}
		var err error
		switch head.Type {
		case "meta":
		case "op":
			var op Op
			err = strict(line, &op)
			history.Ops = append(history.Ops, op)
		case "nemesis":
			var event Event
			err = strict(line, &event)
			history.Events = append(history.Events, event)
		case "scan":
			if history.Scan != nil {
				return nil, fmt.Errorf("line %d: a second scan", number)
			}
			history.Scan = &Scan{}
			err = strict(line, history.Scan)
		default:
			err = fmt.Errorf("unknown type %q", head.Type)
		}
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", number, err)
		}
	}
	if err := lines.Err(); err != nil {
		return nil, err
	}
	if history.Scan == nil {
		return nil, fmt.Errorf("no scan: a history ends with the table's final scan")
	}
	return history, nil
}

// strict decodes one line, refusing fields this checker does not know (but the line's "type").
func strict(line []byte, into interface{}) error {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(line, &fields); err != nil {
		return err
	}
	delete(fields, "type")
	rest, err := json.Marshal(fields)
	if err != nil {
		return err
	}
	decoder := json.NewDecoder(bytes.NewReader(rest))
	decoder.DisallowUnknownFields()
	return decoder.Decode(into)
}

// fingerprint is a request's identity as the API compares it: workflow_ref, input and goal_id, the
// input's keys in any order (canonical JSON: object keys sorted, numbers as written).
func fingerprint(workflowRef string, input json.RawMessage, goalID *string) (string, error) {
	decoder := json.NewDecoder(bytes.NewReader(input))
	decoder.UseNumber()
	var value interface{}
	if err := decoder.Decode(&value); err != nil {
		return "", fmt.Errorf("input: %w", err)
	}
	canonical, err := json.Marshal([]interface{}{workflowRef, value, goalID})
	if err != nil {
		return "", err
	}
	return string(canonical), nil
}

func (run *Run) fingerprint() (string, error) {
	return fingerprint(run.WorkflowRef, run.Input, run.GoalID)
}

// requestFingerprint is the fingerprint of a spawn's request body.
func (op *Op) requestFingerprint() (string, error) {
	var request struct {
		WorkflowRef string          `json:"workflow_ref"`
		Input       json.RawMessage `json:"input"`
		GoalID      *string         `json:"goal_id"`
	}
	if err := json.Unmarshal(op.Request, &request); err != nil {
		return "", fmt.Errorf("request: %w", err)
	}
	return fingerprint(request.WorkflowRef, request.Input, request.GoalID)
}

// marker is the unique marker a keyless run's input carries ("" if none).
func (run *Run) marker() string {
	var input struct {
		Marker string `json:"marker"`
	}
	if json.Unmarshal(run.Input, &input) != nil {
		return ""
	}
	return input.Marker
}
