"""Running a container in a sandbox: the OCI bundle, the image's user and command, the
runtime (runc/crun).

Modules: ``bundle``, ``imagecommand``, ``imageuser``, ``runner``."""
