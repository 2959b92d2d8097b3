"""The core API and what it returns: `broker` (Broker, Sandbox, Owner: the embedded API every
front end goes through), `caller` (who asks, and the one place that decides what it may do),
`results` (one type per JSON document), `verbs` and `transfer` (what both kinds of sandbox share),
`exec_stream` (an exec's output while it runs). Nothing is imported here: a client that needs
the results alone does not load the broker."""
