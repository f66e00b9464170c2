"""What every stage shares: params, one-line errors and bounded reading, atomic outputs,
the report split into facts and run figures, secret redaction, the CPU count (the one
module here no stage depends on in dvc.yaml: it shapes no byte)."""
