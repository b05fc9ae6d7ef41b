"""Silent-data-corruption detection and fault injection: step checksums (sdc.py), replay (replay.py), bit flips
(faults.py), and the guard that runs them beside training (guard.py)."""
