/*
 * A stand-in for pyxis in the test SLURM (tests/slurm/setup.sh builds and loads it): srun accepts
 * --container-image, --container-mounts and --container-workdir as pyxis does, and the task runs on this
 * host instead of in a container, in the host folder that --container-mounts maps --container-workdir to.
 * A workdir no mount maps, a malformed mount or a workdir without an image fail the task with one line, as
 * pyxis would fail it; the task's environment records the image (NEMO_JQ_TEST_CONTAINER_IMAGE) and the
 * workdir, so tests can see what srun was given.
 * A pyxis image has no SLURM client: with the plugin argument without_slurm_client=DIR (setup.sh's copy of the
 * client's folder less the client's programs), every folder of the task's PATH that holds scontrol is replaced by
 * DIR, so that scontrol, sbatch, srun ... are not found inside the "container", while bash and python are.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(nemo_jq_container, 1);

static char *image = NULL, *mounts = NULL, *workdir = NULL;
static const char WITHOUT_CLIENT[] = "without_slurm_client=";

static int keep(char **slot, const char *value)
{
    free(*slot);
    *slot = value ? strdup(value) : NULL;
    return 0;
}

static int on_image(int val, const char *optarg, int remote) { (void)val; (void)remote; return keep(&image, optarg); }
static int on_mounts(int val, const char *optarg, int remote) { (void)val; (void)remote; return keep(&mounts, optarg); }
static int on_workdir(int val, const char *optarg, int remote) { (void)val; (void)remote; return keep(&workdir, optarg); }

struct spank_option spank_options[] = {
    {"container-image", "[REGISTRY#]IMAGE[:TAG]|PATH", "[test pyxis] the image (recorded, not run)", 1, 0, on_image},
    {"container-mounts", "SRC:DST[,SRC:DST...]", "[test pyxis] host:container folder pairs", 1, 0, on_mounts},
    {"container-workdir", "PATH", "[test pyxis] working directory inside the container", 1, 0, on_workdir},
    SPANK_OPTIONS_TABLE_END,
};

/* The host folder that maps to container path `path` through `mounts` (longest container prefix wins). */
static int host_path(const char *path, char *out, size_t size)
{
    char *copy = strdup(mounts ? mounts : ""), *save = NULL, *pair;
    size_t best = 0;
    int found = 0;
    for (pair = strtok_r(copy, ",", &save); pair; pair = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(pair, ':');
        if (!colon) {
            slurm_error("nemo_jq_container: mount %s is not SRC:DST", pair);
            free(copy);
            return -1;
        }
        *colon = '\0';
        char *dst = colon + 1, *flags = strchr(dst, ':');
        if (flags)
            *flags = '\0'; /* SRC:DST:ro */
        size_t n = strlen(dst);
        while (n > 1 && dst[n - 1] == '/')
            dst[--n] = '\0';
        int under = strncmp(path, dst, n) == 0 && (path[n] == '\0' || path[n] == '/' || strcmp(dst, "/") == 0);
        if (under && n >= best) {
            best = n;
            found = 1;
            snprintf(out, size, "%s%s", pair, strcmp(dst, "/") == 0 ? path : path + n);
        }
    }
    free(copy);
    return found ? 0 : -1;
}

/* The task's PATH with each folder that holds scontrol replaced by `without_client`. */
static int hide_slurm_client(spank_t sp, const char *without_client)
{
    char path[8192], hidden[16384] = "", program[4096], *save = NULL, *folder;
    if (spank_getenv(sp, "PATH", path, sizeof(path)) != ESPANK_SUCCESS) {
        slurm_error("nemo_jq_container: cannot read the task's PATH");
        return -1;
    }
    for (folder = strtok_r(path, ":", &save); folder; folder = strtok_r(NULL, ":", &save)) {
        snprintf(program, sizeof(program), "%s/scontrol", folder);
        const char *kept = access(program, X_OK) == 0 ? without_client : folder;
        if (strlen(hidden) + strlen(kept) + 2 > sizeof(hidden)) {
            slurm_error("nemo_jq_container: the task's PATH is too long");
            return -1;
        }
        if (hidden[0])
            strcat(hidden, ":");
        strcat(hidden, kept);
    }
    return spank_setenv(sp, "PATH", hidden, 1) == ESPANK_SUCCESS ? 0 : -1;
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    if (!image && !mounts && !workdir)
        return 0;
    if (!image) {
        slurm_error("nemo_jq_container: --container-mounts/--container-workdir need --container-image");
        return -1;
    }
    spank_setenv(sp, "NEMO_JQ_TEST_CONTAINER_IMAGE", image, 1);
    for (int i = 0; i < ac; i++)
        if (strncmp(av[i], WITHOUT_CLIENT, strlen(WITHOUT_CLIENT)) == 0 &&
            hide_slurm_client(sp, av[i] + strlen(WITHOUT_CLIENT)) < 0)
            return -1;
    if (workdir) {
        char host[4096];
        if (host_path(workdir, host, sizeof(host)) < 0) {
            slurm_error("nemo_jq_container: --container-workdir %s is in no mount of --container-mounts %s", workdir,
                        mounts ? mounts : "(none)");
            return -1;
        }
        if (chdir(host) < 0) {
            slurm_error("nemo_jq_container: cannot enter %s (for %s): %s", host, workdir, strerror(errno));
            return -1;
        }
        spank_setenv(sp, "PWD", host, 1);
        spank_setenv(sp, "NEMO_JQ_TEST_CONTAINER_WORKDIR", workdir, 1);
    }
    return 0;
}
