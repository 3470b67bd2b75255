"""The sidecar process: pure planning, the NIXL worker thread and the asyncio servers."""
