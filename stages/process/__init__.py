"""How a stage process runs, shaping no byte of any out: its command line, the CPUs it may
use, its worker processes. No stage depends on this folder in dvc.yaml."""
