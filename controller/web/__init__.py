"""The controller's HTTP faces: the API app, caller checks, the dashboard and its views."""
