"""Admin and developer tools built on the state service: drill, demo, up, example, and the
services as subprocesses they start (processes)."""
