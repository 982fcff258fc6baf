"""``python -m clusterkit``."""

from clusterkit.cli import program

if __name__ == "__main__":
    program()
