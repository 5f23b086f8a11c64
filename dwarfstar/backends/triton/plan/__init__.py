"""`dwarfstar bench gpu-plan`: a decode step recorded, compiled for a GPU target and modelled, with
no GPU (`recorder`, `target`, `disasm`, `predict`, `report`)."""
