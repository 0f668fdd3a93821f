"""ignis.runtime: artifact loading, executors, drafters, acceptance, lanes, the server."""
