"""The sans-I/O protocol core: no asyncio, sockets, clocks or backends here (a test enforces it)."""
