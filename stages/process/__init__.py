"""How a stage process runs, shaping no byte of any out: its command line, its worker
processes. No stage depends on this folder in dvc.yaml."""
