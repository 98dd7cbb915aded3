"""Environments for agentic rollouts and the sandbox their untrusted code runs in: the environment protocol
(protocol.py), env hosts that run episodes in Ray actors (host.py) and the driver's client for them (client.py), the
sandbox (sandbox.py, pool.py) and a python tool environment (python_tool.py). Rollout functions and rewards drive this
package; it imports neither."""
