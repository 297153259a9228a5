"""`python -m statesvc.loractl`: the `loractl` command."""
from statesvc.loractl.cli import main

if __name__ == "__main__":
    main()
