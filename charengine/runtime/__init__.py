"""charrun: load an engine, check it against the machine, run sessions, pace and stream."""
