"""OpenAPI description of the token scheme (loaded by AccountsConfig.ready)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class TokenAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.accounts.authentication.TokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey", "in": "header", "name": "Authorization",
            "description": "`Token <key>`; create one with `manage.py relaygr_token` or POST /api/v1/tokens/.",
        }
