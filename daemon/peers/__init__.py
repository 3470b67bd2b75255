"""Sidecar-to-sidecar: the handshake (messages, server, client) and the NIXL links it feeds."""
