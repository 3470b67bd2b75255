"""What an engine imports: the layout model, the wire protocol, memory references and the client."""
