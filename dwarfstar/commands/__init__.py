"""CLI command modules; each registers its commands on an app of `dwarfstar.commands.apps`, and imports
heavy modules (torch, the engine, the server, the hub client) only inside the command."""
