"""A Jepsen-style history check of the admission API: clients record what they sent and what each answer
said while faults are injected (history.py, workload.py, nemesis.py, stack.py, run.py), and Porcupine
checks the history (the Go program in this folder, run by check.py). `make test` runs a bounded history
(tests/integration/test_history.py), `make soak` a long one (benchmarks/history.py). The same for the whole
pipeline (dispatch → relay → admission → outbox): pipeline.py checks what observe.py reads from a stack
after benchmarks/soak.py's run, in `make soak` and, bounded, in tests/integration/test_pipeline_history.py."""
