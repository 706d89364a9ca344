"""Resuming a session: after a dropped connection on the same server (a lease, a token, the
events it missed: `lease`, with the session's numbered events in `realtime.emitter`), or on
another server from a checkpoint (`checkpoint`: the format and the store; `takeover`: when to
checkpoint, the client events logged since, claiming and restoring). `state` is what resuming
keeps of each session beside it; `resumer` is the server's side of all of it."""
