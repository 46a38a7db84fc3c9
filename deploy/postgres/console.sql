-- The login role docker-compose.yml's console service connects as: a member of
-- outbox_console, which `outbox db upgrade --create-roles` (the migrate service) grants what
-- the console reads and resumes, and nothing more (it creates the group role only if absent).
-- Run by PostgreSQL's image on the first start of an empty data directory. Change the
-- password, here and in the console service's OUTBOX_DATABASE_URL, for anything but a demo.
DO $role$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_console') THEN
        CREATE ROLE outbox_console NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'console') THEN
        CREATE ROLE console LOGIN PASSWORD 'console' IN ROLE outbox_console;
    END IF;
END
$role$;
