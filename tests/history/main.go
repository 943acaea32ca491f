// Command poimen-history-check checks a history of the admission API recorded by tests/history
// (history.py): each dispatch key, and each keyless run, must be a linearizable first-writer-wins
// register (Porcupine), and the table's final scan must agree with the answers. It prints a JSON report;
// on a violation it writes Porcupine's HTML visualization of the partitions at fault.
//
// Usage: poimen-history-check [-visualization PATH] [-timeout DURATION] HISTORY
// Exit codes: 0 the history holds, 1 it does not, 2 the history could not be read.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"
)

func main() {
	visualization := flag.String("visualization", "", "where to write the HTML visualization on a violation")
	timeout := flag.Duration("timeout", time.Minute, "Porcupine's bound for each partition (0: none)")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: poimen-history-check [-visualization PATH] [-timeout D] HISTORY")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	history, err := readHistory(flag.Arg(0))
	if err != nil {
		fmt.Fprintf(os.Stderr, "poimen-history-check: %s: %v\n", flag.Arg(0), err)
		os.Exit(2)
	}
	report := check(history, *visualization, *timeout)
	encoder := json.NewEncoder(os.Stdout)
	encoder.SetIndent("", "  ")
	if err := encoder.Encode(report); err != nil {
		fmt.Fprintf(os.Stderr, "poimen-history-check: %v\n", err)
		os.Exit(2)
	}
	if !report.OK {
		os.Exit(1)
	}
}
