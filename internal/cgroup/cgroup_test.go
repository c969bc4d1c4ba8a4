package cgroup

import (
	"io/fs"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/stretchr/testify/require"
)

func fakeTree(files map[string]string) ReadFile {
	m := fstest.MapFS{}
	for p, c := range files {
		m[p] = &fstest.MapFile{Data: []byte(c)}
	}
	return func(name string) ([]byte, error) {
		return fs.ReadFile(m, strings.TrimPrefix(name, "/"))
	}
}

func TestLevels(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files map[string]string
		want  []Level
	}{
		{"v2 leaf", map[string]string{
			"proc/self/cgroup":                           "0::/kubepods/pod1\n",
			"sys/fs/cgroup/kubepods/pod1/memory.max":     "17179869184\n",
			"sys/fs/cgroup/kubepods/pod1/memory.current": "1073741824\n",
		}, []Level{
			{Version: 2, LimitFile: "/sys/fs/cgroup/kubepods/pod1/memory.max", Limit: 17179869184, Usage: 1073741824},
		}},
		{"v2 nested, leaf unlimited", map[string]string{
			"proc/self/cgroup":                 "0::/a/b\n",
			"sys/fs/cgroup/a/b/memory.max":     "max\n",
			"sys/fs/cgroup/a/b/memory.current": "100\n",
			"sys/fs/cgroup/a/memory.max":       "8589934592\n",
			"sys/fs/cgroup/a/memory.current":   "200\n",
			"sys/fs/cgroup/memory.max":         "4096\n",
			"sys/fs/cgroup/memory.current":     "300\n",
			"memory.max":                       "1\n",
		}, []Level{
			{Version: 2, LimitFile: "/sys/fs/cgroup/a/b/memory.max", Unlimited: true, Usage: 100},
			{Version: 2, LimitFile: "/sys/fs/cgroup/a/memory.max", Limit: 8589934592, Usage: 200},
			{Version: 2, LimitFile: "/sys/fs/cgroup/memory.max", Limit: 4096, Usage: 300},
		}},
		{"v1", map[string]string{
			"proc/self/cgroup": "12:cpu,cpuacct:/x\n9:memory:/docker/abc\n",
			"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "4294967296\n",
			"sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": "65536\n",
			"sys/fs/cgroup/memory/memory.limit_in_bytes":            "9223372036854771712\n",
			"sys/fs/cgroup/memory/memory.usage_in_bytes":            "131072\n",
			"sys/fs/cgroup/cpu,cpuacct/x/memory.limit_in_bytes":     "1\n",
		}, []Level{
			{Version: 1, LimitFile: "/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", Limit: 4294967296, Usage: 65536},
			{Version: 1, LimitFile: "/sys/fs/cgroup/memory/memory.limit_in_bytes", Limit: 9223372036854771712, Unlimited: true, Usage: 131072},
		}},
		{"v1 memory among other controllers", map[string]string{
			"proc/self/cgroup": "4:cpu,memory,pids:/j\n",
			"sys/fs/cgroup/memory/j/memory.limit_in_bytes": "1048576",
			"sys/fs/cgroup/memory/j/memory.usage_in_bytes": "0",
		}, []Level{
			{Version: 1, LimitFile: "/sys/fs/cgroup/memory/j/memory.limit_in_bytes", Limit: 1048576},
		}},
		{"hybrid: v2 line then v1 line, in file order", map[string]string{
			"proc/self/cgroup":                             "0::/u\n3:memory:/m\n",
			"sys/fs/cgroup/u/memory.max":                   "2048\n",
			"sys/fs/cgroup/u/memory.current":               "1\n",
			"sys/fs/cgroup/memory/m/memory.limit_in_bytes": "1024\n",
			"sys/fs/cgroup/memory/m/memory.usage_in_bytes": "2\n",
		}, []Level{
			{Version: 2, LimitFile: "/sys/fs/cgroup/u/memory.max", Limit: 2048, Usage: 1},
			{Version: 1, LimitFile: "/sys/fs/cgroup/memory/m/memory.limit_in_bytes", Limit: 1024, Usage: 2},
		}},
		{"missing and malformed limit files are left out", map[string]string{
			"proc/self/cgroup":             "0::/a/b/c\n",
			"sys/fs/cgroup/a/b/memory.max": "lots\n",
			"sys/fs/cgroup/a/memory.max":   "-5\n",
			"sys/fs/cgroup/memory.max":     "99999999999999999999\n",
		}, nil},
		{"v1 does not know max", map[string]string{
			"proc/self/cgroup":                           "9:memory:/\n",
			"sys/fs/cgroup/memory/memory.limit_in_bytes": "max\n",
		}, nil},
		{"dot-dot stays inside the tree", map[string]string{
			"proc/self/cgroup": "0::/../../../..\n",
			"memory.max":       "512\n",
			"memory.current":   "12\n",
		}, []Level{
			{Version: 2, LimitFile: "/memory.max", Limit: 512, Usage: 12},
		}},
		{"no memory hierarchy", map[string]string{
			"proc/self/cgroup": "12:cpu,cpuacct:/x\nbroken line\n",
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Levels(fakeTree(tc.files))
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestLevelsUsageUnknown(t *testing.T) {
	got, err := Levels(fakeTree(map[string]string{
		"proc/self/cgroup":             "0::/a\n",
		"sys/fs/cgroup/a/memory.max":   "4096\n",
		"sys/fs/cgroup/memory.max":     "8192\n",
		"sys/fs/cgroup/memory.current": "many\n",
	}))
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Equal(t, int64(4096), got[0].Limit)
	require.Zero(t, got[0].Usage)
	require.ErrorIs(t, got[0].UsageErr, fs.ErrNotExist)
	require.Equal(t, int64(8192), got[1].Limit)
	require.Zero(t, got[1].Usage)
	require.ErrorContains(t, got[1].UsageErr, "/sys/fs/cgroup/memory.current")
}

func TestLevelsNoProcFile(t *testing.T) {
	got, err := Levels(fakeTree(nil))
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.ErrorContains(t, err, "/proc/self/cgroup")
	require.Nil(t, got)
}

// FuzzLevels feeds arbitrary /proc/self/cgroup contents: the walk must end,
// stay inside the tree and list only limit files that exist.
func FuzzLevels(f *testing.F) {
	f.Add("0::/a/b\n")
	f.Add("9:memory:/docker/abc\n0::/\n")
	f.Add("0::../../x\n1:memory,cpu:/../..\n")
	f.Add("::::\n0::\n")
	files := map[string]string{
		"sys/fs/cgroup/a/memory.max":                 "100",
		"sys/fs/cgroup/memory.max":                   "max",
		"sys/fs/cgroup/memory/memory.limit_in_bytes": "200",
		"memory.max": "300",
	}
	f.Fuzz(func(t *testing.T, procCgroup string) {
		tree := map[string]string{"proc/self/cgroup": procCgroup}
		for k, v := range files {
			tree[k] = v
		}
		got, err := Levels(fakeTree(tree))
		require.NoError(t, err)
		for _, lv := range got {
			require.Contains(t, tree, lv.LimitFile[1:])
		}
	})
}
