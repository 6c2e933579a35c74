"""Running a container in a sandbox (the symptom: ``layerfs run`` fails).

- ``runner``: runs a command in a sandbox with the OCI runtime (runc, crun)
- ``bundle``: the OCI runtime bundle (``config.json``) and its directory
- ``imageuser``: the user an image's process runs as, from the image's own files
- ``imagecommand``: whether the container's command can start (127, 126)
- ``programahead``: the programs a command will exec, read ahead while the runtime starts
- ``freezer``: the cgroup freezer over a sandbox's containers (what ``suspend`` holds still)
"""
