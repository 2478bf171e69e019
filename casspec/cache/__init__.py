"""The user cache: its files, keys and locks (usercache.py) and the state generations learn (state.py)."""
