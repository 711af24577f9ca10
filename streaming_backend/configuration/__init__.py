"""The models' settings, defined once.

`parameters`: a typed parameter table (`Parameter`, `ParameterTable`) and its checks.
`models`: both models' tables (`CHAT_PARAMETERS`, `DIALOGUE_PARAMETERS`) and their typed
settings (`EngineConfig`, ...), from which the config.pbtxt files, `tokenstream serve`'s
options and the docs' tables come. `endpoints`: the default ports and addresses.
"""
