"""Stand-in for MineStudio (tests only; see tests/standins/README.md)."""
