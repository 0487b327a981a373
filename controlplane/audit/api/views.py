from drf_spectacular.utils import extend_schema
from rest_framework.generics import GenericAPIView

from controlplane.common.views import error_responses, validated

from .. import selectors
from .serializers import AuditEntrySerializer, AuditQuerySerializer


class AuditListView(GenericAPIView):
    serializer_class = AuditEntrySerializer

    def get_queryset(self):  # the browsable API and the schema ask for it; ``get`` filters by the query
        return selectors.audit_list()

    @extend_schema(parameters=[AuditQuerySerializer], responses={200: AuditEntrySerializer(many=True),
                                                                 **error_responses(400, 401, 403)})
    def get(self, request):
        query = validated(AuditQuerySerializer, request.query_params)
        page = self.paginate_queryset(selectors.audit_list(**query))
        return self.get_paginated_response(AuditEntrySerializer(page, many=True).data)
