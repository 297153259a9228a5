"""Admin and developer tools built on the state service: drill, demo, up, example, inproc."""
