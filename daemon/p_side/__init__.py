"""P side: what a sidecar answers its readers' sidecars about the holds it keeps.

- :mod:`.control`: claims, renewals and abandons (peers/control.py messages),
  each checked against the hold token and the agent the reader linked to;
- :mod:`.digests`: byte-verification digests of held pages;
- :mod:`.readers`: reader agents declared in handshakes, and the NIXL
  notifications that end holds (accepted only from the declared agent);
- :mod:`.spans`: the tracing span of each hold.
"""
