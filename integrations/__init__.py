"""Adapters that plug kvsidecar into inference engines, one subpackage per engine.

Each imports its engine and the engine side of kvsidecar (:mod:`kvsidecar.ipc`);
nothing in :mod:`kvsidecar.ipc` or the daemon imports them.
"""
