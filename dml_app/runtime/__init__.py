"""What a node process stands on: its HTTP router and client (``http``), who may call it and how
its messages are signed (``auth``), how a role's messages reach peers (``transport``), its event
log (``events``), the thread that runs its model (``compute``) and the loading of a user's files
(``usercode``). Nothing here knows a role, a model or a policy."""
