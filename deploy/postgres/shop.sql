-- The example business table the compose file's SQL checker reads (the FastAPI example's
-- shop.orders), and the grants that checker needs: SQL checkers run as <schema>_checker,
-- which may read only what it is granted. Run by PostgreSQL's image on the first start of an
-- empty data directory (/docker-entrypoint-initdb.d); `outbox db upgrade --create-roles`
-- keeps the role (it creates it only if absent). Replace it with your own tables and grants.
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.orders (
    id serial PRIMARY KEY,
    customer text NOT NULL,
    total numeric(10, 2) NOT NULL,
    state text NOT NULL DEFAULT 'placed'
);
DO $role$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_checker') THEN
        CREATE ROLE outbox_checker NOLOGIN;
    END IF;
END
$role$;
GRANT USAGE ON SCHEMA shop TO outbox_checker;
GRANT SELECT ON shop.orders TO outbox_checker;
