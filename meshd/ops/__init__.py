"""The operator CLI: `meshd models|vmodels|instances`, a client of one meshd's external port.

Registration and vmodels go through the ModelMesh management API (`mmesh.ModelMesh`), so
they behave exactly as for upstream clients; listings use meshd's `meshd.admin.MeshAdmin`.
A client: it shares nothing with the daemon but the protos and the TLS helpers.

May import: core, security.
"""
