"""`python -m gateway`, the same as the `furnace-gateway` command."""

from gateway.cli import main

if __name__ == "__main__":
    main()
