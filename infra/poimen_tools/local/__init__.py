"""Local-only tools: run the Lambda handlers of template.yaml on a workstation, against moto server."""
