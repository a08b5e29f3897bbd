"""The developer launcher: `moemesh up` runs a whole mesh as local processes on loopback (`up.py`,
`local_cluster.py`), with a throwaway Redis (`redis_server.py`). Services never import it."""
