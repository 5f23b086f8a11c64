"""CLI command modules; each registers its commands on `dwarfstar.cli.app`."""
