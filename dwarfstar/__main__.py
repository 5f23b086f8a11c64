from dwarfstar.cli import main

main()
