"""The load generator: real Realtime WebSocket clients streaming speech in real time."""
