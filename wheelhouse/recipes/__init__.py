"""How a project is built: the recipe book (the TOML files beside this module) and the patches it
applies (the .diff files here).
"""
