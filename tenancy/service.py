"""All the tenancy data functions in one namespace, for callers that use several resources
(tests, benchmarks). Each lives in its resource's module: `tenancy.plans`, `tenancy.tenants`,
`tenancy.api_keys`, `tenancy.admin_keys`; the auth version in `tenancy.auth_state`, the errors
in `tenancy.errors`, every setting's bounds in `tenancy.fields`.
"""

from tenancy.admin_keys import (
    count_admin_keys,
    create_admin_key,
    list_admin_keys,
    load_admin_context,
    revoke_admin_key,
)
from tenancy.api_keys import (
    create_api_key,
    get_api_key,
    list_api_keys,
    load_key_context,
    revoke_api_key,
)
from tenancy.auth_state import auth_version, commit_mutation
from tenancy.errors import ConflictError, InvalidError, NotFoundError, ServiceError
from tenancy.fields import check_name
from tenancy.plans import (
    budgeted_tenants,
    create_plan,
    get_plan,
    get_plan_by_name,
    list_plans,
    plan_limits,
    update_plan,
)
from tenancy.tenants import (
    UNSET,
    Unset,
    create_tenant,
    get_tenant,
    get_tenant_by_name,
    list_tenants,
    update_tenant,
)

__all__ = [
    "UNSET",
    "ConflictError",
    "InvalidError",
    "NotFoundError",
    "ServiceError",
    "Unset",
    "auth_version",
    "budgeted_tenants",
    "check_name",
    "commit_mutation",
    "count_admin_keys",
    "create_admin_key",
    "create_api_key",
    "create_plan",
    "create_tenant",
    "get_api_key",
    "get_plan",
    "get_plan_by_name",
    "get_tenant",
    "get_tenant_by_name",
    "list_admin_keys",
    "list_api_keys",
    "list_plans",
    "list_tenants",
    "load_admin_context",
    "load_key_context",
    "plan_limits",
    "revoke_admin_key",
    "revoke_api_key",
    "update_plan",
    "update_tenant",
]
