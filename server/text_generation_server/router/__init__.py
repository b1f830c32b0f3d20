"""The router inside `serve`: shard discovery, warmup, the client API, metrics.

main.py (run_router: startup, serving, draining), client.py (the shard client), validation.py,
scheduler.py, block_pool.py, service.py (the client API), health.py, reflection.py, auth.py,
tls.py, metrics.py.
"""
