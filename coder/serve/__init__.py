"""Serving: an OpenAI-compatible HTTP server over the engine (server.py) and the log of every
served token and every user signal (trajectory_log.py), read by the realtime stage."""
