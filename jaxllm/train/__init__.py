"""The objective-agnostic training core: what an objective provides (`objective`), the train state (`state`), the
step and its compiled runner (`step`, `step_runner`, `diagnostic_step`), the loop (`fit`; `loop` keeps the public
`jaxllm.train.loop.train`), resume and recovery (`recovery`), anomaly detection (`anomaly`), live control and
fault injection (`control`, `faults`), and the metrics log with its progress line (`metrics_log`)."""
